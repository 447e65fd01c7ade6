"""Serving one request in the inference worker: the server, the runtimes, planning, the
engine and its batch, sampling, citing, the prefix cache, the loading controller, routing."""
