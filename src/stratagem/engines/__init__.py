"""Running a stratagem job on other machinery than one machine's processes.

- :mod:`stratagem.engines.ray`: a job as Ray actors, one per task (``stratagem launch --ray``,
  ``stratagem.ray.run``); needs ``pip install 'stratagem[ray]'``.
- :mod:`stratagem.engines.ray_task`: what each of those actors does (runs the task's process).
- :mod:`stratagem.engines.k8s`: Kubernetes manifests, a Kubeflow TFJob or MPIJob and the Secret
  holding the cluster secret (``stratagem k8s manifest``).

Slurm needs no engine: ``srun python train.py`` resolves its cluster itself (:mod:`stratagem.core.slurm`).
Nothing here is imported by ``import stratagem``.
"""
