"""Blending stored chunks' KV at question time: the driver (``prefill``), placing,
selection, the selected tokens' attention, refresh, and the measured ratio curve."""
