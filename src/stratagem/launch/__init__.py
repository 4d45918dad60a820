"""Starting a job: ``stratagem launch`` and the engines it can run on.

- :mod:`.launcher`: a local cluster, one supervised process per task (``stratagem launch``), with
  :mod:`.task_output` prefixing each task's output;
- :mod:`.supervisor`: the supervision every launch shares (start, watch exits, the deadline and
  signals, stop with a grace period then SIGKILL, reap), and :mod:`.job`: what every launch checks
  and gives its tasks (options, the secret, the environment);
- :mod:`.mpi`: the same command as one MPI job on this machine (``stratagem launch --mpi``);
- :mod:`.ray` / :mod:`.ray_task`: a job as Ray actors (``stratagem launch --ray``, ``stratagem.ray.run``);
  needs ``pip install 'stratagem[ray]'``;
- :mod:`.multinode`: one job over several machines, a launcher per node (``stratagem launch --nnodes N
  --node-rank I --rdzv HOST:PORT``), which meet at node 0 through :mod:`.rendezvous`; :mod:`.hostfile`
  starts them all from one machine (``stratagem launch --hostfile FILE``);
- :mod:`.k8s`: Kubernetes manifests, a Kubeflow TFJob or MPIJob (``stratagem k8s manifest``).

Slurm and TF_CONFIG need no launcher here: the script resolves its cluster itself
(:mod:`stratagem.core.cluster`, :mod:`stratagem.core.slurm`).
"""
