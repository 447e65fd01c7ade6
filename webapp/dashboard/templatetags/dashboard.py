"""``{% load dashboard %}``: the product's number formats (``webapp.units``), which every
template has already."""

from webapp.units import register  # noqa: F401  (the library Django loads by this name)
