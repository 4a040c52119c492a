"""The APIs: one endpoint class per generation API over the serving core (`endpoint.py`; `completions.py`,
`chat.py`, `responses.py` + `responses_request.py`, `messages.py` + `messages_request.py`: Responses and
Anthropic's Messages read into the chat body they mean and served as chat), and the routes beside them
(`tokenization.py`: /tokenize, /detokenize; `control_routes.py`: a trainer's calls). Imports the core, the
parsers and the protocol; nothing below imports it."""
