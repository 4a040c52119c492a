"""The serving core: a validated body into engine requests (`parsing.py`, with its tool plan `tools.py` and output
constraint `constraints.py`), the engine thread (`worker.py`, `pause.py`, `heap.py`) and its typed events
(`events.py`), events into an answer (`jobs.py`, `streaming.py`), what one app holds (`state.py`, `config.py`,
`metrics.py`, `control.py`). Imports the parsers and the protocol, never an API."""
