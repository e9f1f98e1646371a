"""Training monitors: TensorBoard, CSV and W&B writers driven by the config (DeepSpeed's ``monitor``).

``Monitor(config)`` holds the enabled writers (rank 0); ``StepEvents`` is what the engine feeds
each step. See :mod:`zerospeed.monitor.master` and :mod:`zerospeed.monitor.step_events`.
"""

from zerospeed.monitor.master import Monitor
from zerospeed.monitor.step_events import StepEvents
from zerospeed.monitor.writers import CSVWriter, TensorBoardWriter, WandbWriter, csv_file_name

__all__ = ["CSVWriter", "Monitor", "StepEvents", "TensorBoardWriter", "WandbWriter", "csv_file_name"]


from zerospeed._submodules import lazy_submodules as _lazy_submodules

__getattr__ = _lazy_submodules(__name__)  # zerospeed.<package>.<submodule> after `import zerospeed` (issue #27)
