"""What a training replica holds and does, whatever the strategy: variables, optimizers, checkpoints.

- :mod:`.variables`: ``Variable`` and the variable store a strategy's scope creates into;
- :mod:`.optimizers`: the update rules (Keras/TF and ``torch.optim`` flavours) and their base class;
- :mod:`.checkpoint`: checkpoint files; :mod:`.sparse`: row (embedding) gradients;
- :mod:`.replica_sync`: plain data, arrays and nested states shared between replicas;
- :mod:`.sharding`: how a global batch is split over the replicas.
"""
