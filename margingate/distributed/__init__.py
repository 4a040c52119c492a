"""Scale-out on Ray, an optional extra (`pip install 'margingate[ray]'`).

- offline.py: `generate` and `check` spread over a pool of engine actors (one engine each);
- serve.py: `serve --replicas N`, the OpenAI app as a Ray Serve deployment of N engine replicas;
- options.py: the command-line options and connecting to Ray.

The tokens do not depend on which worker decodes a request, nor on its thread count, for
the policies that promise determinism: the invariant kernels fix every reduction's order by
the row alone. That is what lets workers with different core budgets agree with one local engine.
"""
from __future__ import annotations

RAY_EXTRA = "pip install 'margingate[ray]'"


def require_ray(what: str, serve: bool = False):
    """The `ray` module, or a ValueError saying which pip install fixes its absence."""
    try:
        import ray
        if serve:
            import ray.serve  # noqa: F401  (its own dependencies come with ray[serve])
    except ImportError as exc:
        raise ValueError(f"{what} needs Ray ({exc.name} is not installed): {RAY_EXTRA}") from None
    return ray
