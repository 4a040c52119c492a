"""The wire: request bodies validated (`common.py`: the fields every generation body shares, `BadRequest`;
`bodies.py`, `formats.py`, `sdk_fields.py`), error answers (`errors.py`) and logprobs in OpenAI's shapes
(`logprobs.py`). Imports nothing else of the server."""
