"""The determinism contract: one request's tokens, whatever shares its batch, at any thread count."""
