"""``stratagem advise``: measure this cluster, predict every strategy x transport x ps count, recommend one.

- :mod:`.probe` runs the measurements (jobs of :mod:`.probe_task`, and of the script ``steps_task.py``
  for the strategies' own steps, started like the bench's);
- :mod:`.costmodel` is the model: pure functions from the figures to predicted step times;
- :mod:`.cli` is the command.
"""
