"""Optimizers: the base class (:mod:`.base`), the Keras/TF rules (:mod:`.rules`), ``torch.optim``'s
rules (:mod:`.torch_rules`), chunked elementwise updates (:mod:`.chunks`) and row updates for sparse
gradients (:mod:`.rows`). The public names are in :mod:`stratagem.optimizers`.
"""
