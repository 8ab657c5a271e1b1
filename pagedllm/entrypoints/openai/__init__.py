"""The OpenAI-compatible HTTP server: `api_server` (app, flags, run), `protocol` (request and
response bodies), `serving_*` (one endpoint family each), `errors` (OpenAI's error body)."""
