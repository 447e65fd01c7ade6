"""The benchmarks: scripts that print numbers and write JSON, never part of the product.

This package sits above the product (``kvservice``, ``webapp``) and the dev stack
(``deploy``): it may import any of them, and none of them imports it.

* ``staging``: where the prefill bench's chunk KV starts (``--tier``) and what loading cost;
* ``store_io``: ``python -m bench.store_io``, how fast each store tier returns chunk KV;
* ``s3``: the SeaweedFS gateway a bench starts where no ``S3_ENDPOINT`` is set.
"""
