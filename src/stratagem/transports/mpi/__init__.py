"""The ``mpi`` transport (mpi4py): :mod:`.transport`, :mod:`.progress` (the progress loop over
nonblocking MPI calls) and :mod:`.collectives` (MPI's native collectives with failure detection).
Imported only when the plugin is used (``pip install 'stratagem[mpi]'``).
"""
