"""Public integration surface, ``hp_fastload.integrations``: the transformers ``Trainer`` callback and the
accelerate helper. They live in ``hp_fastload.api.integrations``; this module only names them (importing it
needs transformers for the callback, accelerate for the helper's call)."""

from hp_fastload.api.integrations import HpFastloadCallback, prepare_pretrained

__all__ = ["HpFastloadCallback", "prepare_pretrained"]
