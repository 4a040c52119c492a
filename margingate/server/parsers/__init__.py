"""The answer parsers: an answer's text, as the engine releases it, read into content, reasoning and tool calls
(`answer.py`, `call_parser.py`, `call_shapes.py`, `reasoning.py`), and the tool-call format they read
(`tool_format.py`). Plain text in, pieces out: imports nothing else of the server."""
