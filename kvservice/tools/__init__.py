"""Tools beside the product: the model checker (``python -m kvservice.tools.check_model``) and
the random-weight models the benchmarks and tests build (``synthetic``). They may use every
room of kvservice; nothing in the product imports them."""
