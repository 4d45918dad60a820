"""Adapters for frameworks that compute gradients: PyTorch (:mod:`stratagem.torch`) and JAX
(:mod:`stratagem.jax`). Each is imported only when used, so ``import stratagem`` imports neither
framework. The modules here hold their parts; the public names are those of ``stratagem.torch`` and
``stratagem.jax``.
"""
