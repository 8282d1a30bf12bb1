"""SCAPE for litgpt: ``lightning-scape pretrain`` (:mod:`~lightning_scape.litgpt.pretrain`), what it adapts
around litgpt's pretraining loop (:mod:`~lightning_scape.litgpt.litgpt_adaptations`) and the
:class:`~lightning_scape.litgpt.data.TextFolder` data module.

Importing this package needs litgpt (``pip install "lightning-scape[litgpt]"``).
"""
