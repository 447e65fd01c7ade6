"""vLLM as the serving engine, with Ragblend's cached and blended KV injected through a
vLLM V1 KV connector.

* ``connector``: ``RagblendConnector`` (loaded by vLLM through ``kv_connector_module_path``)
  and the worker extension that hands the blender vLLM's loaded model.
* ``blender``: our ``Transformer`` interface over vLLM's own layers, so ``blend_prefill``
  runs inside vLLM's worker process on the weights vLLM already holds (see its docstring
  for why, and what a second copy would cost).
* ``engine``: ``VllmEngine``, requests in every mode (full / prefix / reuse / blend) through
  one vLLM ``AsyncLLM``; ``runtime``: the inference worker's ``ENGINE=vllm``.

Nothing here is imported unless ``ENGINE=vllm`` (or the bench/tests) ask for it: vLLM is
an optional install (``make vllm``; see the Makefile). Its bench is ``bench/prefill_vllm.py``
(``python -m kvservice.bench ... --engine vllm``).
"""
