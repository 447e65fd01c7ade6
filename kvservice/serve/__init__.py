"""The inference worker with the native engine: the server, the runtime, the engine and its
batch, citing, the prefix cache. What it shares with the vLLM engine (a request's plan, the
loading controller, decoding) lies below, in ``blend`` and ``model``."""
