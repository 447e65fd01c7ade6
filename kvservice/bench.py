"""``python -m kvservice.bench``: the prefill benchmark under the name the README, the docs
and the issues give it. The benchmark is ``bench/prefill.py`` (the ``bench`` package, above
the product: kvservice never imports it; only running this module does)."""

if __name__ == "__main__":
    from bench.prefill import main

    main()
