"""The knowledge delivery API's client: the worker's KV tier over HTTP."""
