"""``python -m clusterenv_core.worker [<backend> [backend arguments]]``: the worker program.

Everything it needs is imported inside the launch guard (:func:`~.launch.run_worker_program`), so
that a worker whose dependencies fail to import still ends an MPI job instead of leaving it waiting.
"""

import sys

from clusterenv_core.worker.launch import end_worker_program, run_worker_program

end_worker_program(run_worker_program(sys.argv[1:]))
