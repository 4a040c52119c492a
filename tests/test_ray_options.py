"""The Ray options refuse bad input before any model loads, and say which pip install fixes a
missing extra (these run with or without Ray installed)."""
from __future__ import annotations

import socket
import sys

import pytest

from margingate.cli import main


def run(capsys, *argv) -> tuple[int, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse refused it
        code = exc.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["generate", "hi", "--ray", "--ray-workers", "0"], "--ray-workers: expected an integer >= 1, got '0'"),
    (["generate", "hi", "--ray", "--threads-per-worker", "0"], "--threads-per-worker: expected an integer >= 1"),
    (["serve", "--replicas", "0"], "--replicas: expected an integer >= 1, got '0'"),
    (["generate", "hi", "--ray-workers", "2"], "--ray-workers needs --ray"),
    (["check", "--ray", "nohostnoport"], "expected HOST:PORT, ray://HOST:PORT or auto, got 'nohostnoport'"),
])
def test_bad_ray_options_name_the_problem(capsys, argv, message):
    code, err = run(capsys, *argv)
    assert code == 2 and message in err, err


def test_without_ray_the_message_says_what_to_install(capsys, monkeypatch):
    for name in [m for m in sys.modules if m == "ray" or m.startswith("ray.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    for argv in (["generate", "hi", "--ray"], ["check", "--ray", "--limit", "2"], ["serve", "--replicas", "2"]):
        code, err = run(capsys, *argv)
        assert code == 2 and "pip install 'margingate[ray]'" in err, (argv, err)


def test_an_unreachable_cluster_is_named_in_seconds(capsys):
    pytest.importorskip("ray", reason="needs the [ray] extra: pip install 'margingate[ray]'")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, err = run(capsys, "generate", "hi", "--ray", f"127.0.0.1:{port}")
    assert code == 2 and f"no Ray cluster answers at 127.0.0.1:{port}" in err, err


def test_fleet_metrics_add_up_series_by_series():
    from margingate.distributed.metrics import summed

    a = '# HELP m_total n\n# TYPE m_total counter\nm_total{policy="fast"} 2\nm_bucket{le="+Inf"} 1\ng 0.5\n'
    b = '# HELP m_total n\n# TYPE m_total counter\nm_total{policy="fast"} 3\nm_total{policy="x y"} 1\ng 0.25\n'
    assert summed([a, b]) == ('# HELP m_total n\n# TYPE m_total counter\nm_total{policy="fast"} 5\n'
                              'm_bucket{le="+Inf"} 1\ng 0.75\nm_total{policy="x y"} 1\n')
