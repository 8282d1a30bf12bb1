"""SCAPE for litgpt: ``lightning-scape pretrain`` (:mod:`~lightning_scape.litgpt.pretrain`) and the
:class:`~lightning_scape.litgpt.data.TextFolder` data module.

Importing this package needs litgpt (``pip install "lightning-scape[litgpt]"``).
"""
