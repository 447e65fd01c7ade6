"""The benchmarks: scripts that print numbers and write JSON, never part of the product.

This package sits above the product (``kvservice``, ``webapp``) and the dev stack
(``deploy``): it may import any of them, and none of them imports it.

* ``prefill``: TTFT and fidelity of the prefill modes on Musique, ``python -m kvservice.bench``
  (the name the README and the issues give it); ``--synthetic`` runs ``long_context``
  (random weights of a real model's shape), ``--engine vllm`` runs ``prefill_vllm``;
* ``diagnose``: ``python -m bench.diagnose``, which tokens' true KV would recover full's answer;
* ``blend_cost``: ``python -m bench.blend_cost``, where a blend's time goes (attention per pair);
* ``turns``: ``python -m bench.turns``, follow-up questions over their own context KV;
* ``staging``: where the prefill bench's chunk KV starts (``--tier``) and what loading cost,
  S3 throttled (``--s3-mbps N|auto``) through ``throttle``'s proxy, and the per-chunk choice;
* ``kdn``: the ``--tier kdn`` of the prefill bench, KV through the knowledge delivery API,
  and the stack it starts (``python -m bench.kdn``: prints ``KDN_URL`` and ``KDN_KEY``);
* ``codec``: ``python -m bench.codec``, bytes per token against fidelity of the KV codecs;
* ``store_io``: ``python -m bench.store_io``, how fast each store tier returns chunk KV;
* ``answers``: ``python -m bench.answers``, what the user reads (loops, citations, not found);
* ``ingest``: ``python -m bench.ingest``, ingest throughput (or, ``--url``, through a stack);
* ``api``: ``python -m bench.api``, TTFT as the user sees it, through a running stack's API;
* ``routing``: ``python -m bench.routing``, cache-aware against random routing, two workers;
* ``serving``: ``python -m bench.serving``, many users at once: Poisson arrivals through the
  streamed API per mode and rate (vLLM's own server as a mode), and the capacity;
* ``follow_ups``: ``python -m bench.follow_ups``, retrieval of follow-ups, of questions asked
  mid-conversation and of two-part questions (tests/data/follow_ups, tune and held-out halves).

Shared helpers: ``data`` (the shared data folder, Musique passages), ``stats`` (quantile,
bootstrap interval), ``timing`` (device-synchronized timers), ``s3`` (the SeaweedFS gateway
a bench starts where no ``S3_ENDPOINT`` is set). Answers are scored with the product's
``webapp.dashboard.fidelity.token_f1``, as the fidelity audit scores them.
"""
