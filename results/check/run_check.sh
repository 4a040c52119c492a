# Sourced by the check scripts under results/ (kernels-v*/run.sh, quantized/check.sh), from the repository
# root, with O set to the folder the results go to. `run NAME ARGS...` runs `margingate check` with ARGS
# into $O/NAME.txt and .json, keeping a finished run, and prints its token digest and its rate.
export MARGINGATE_CACHE="${MARGINGATE_CACHE:-$PWD/.cache}"
mkdir -p "$O"
run() {
  local name=$1; shift
  grep -q 'token ids sha256' $O/$name.txt 2>/dev/null || \
    .venv/bin/margingate check --modes hetero,staggered --batch-sizes 4,16 --out $O/$name.json "$@" > $O/$name.txt 2>/dev/null
  echo "$name: $(grep -o 'token ids sha256 [0-9a-f]*' $O/$name.txt) $(grep '^  all' $O/$name.txt | awk '{print $3}')"
}
