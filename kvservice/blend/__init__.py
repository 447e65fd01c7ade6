"""Blending stored chunks' KV at question time: the driver (``prefill``), placing,
selection, the selected tokens' attention, refresh; and what either engine is handed for a
request: its plan (``planning``) and the loading controller's ratio (``controller``)."""
