"""Offline design-space exploration: what it costs to run model M on vPod V (paper §2.4, §3.2-3.3).

Public API::

    from dse import BestFitDB, build, BuildOptions, load_model, default_catalog
    db = BestFitDB.load("bestfit-llama3-8b-energy.json")
    e = db.lookup("decode", 3000)            # best chip; e.chip, e.topology, e.tp, ...
"""

from .version import __version__  # noqa: E402,F401

from .errors import NeuScaleError  # noqa: E402
from .catalog import Catalog, ChipSpec, default_catalog, load_chip_file  # noqa: E402
from .vpod import ICITopology, VChipConfig, VPodConfig, enumerate_topologies  # noqa: E402
from .models import ModelArch, load_model, PRESETS  # noqa: E402
from .buckets import SEQ_BUCKETS, BATCH_BUCKETS, bucket_index, bucket_of  # noqa: E402
from .db import BestFitDB, Entry  # noqa: E402
from .builder import BuildOptions, build  # noqa: E402

__all__ = ["NeuScaleError", "Catalog", "ChipSpec", "default_catalog", "load_chip_file",
           "ICITopology", "VChipConfig", "VPodConfig", "enumerate_topologies", "ModelArch",
           "load_model", "PRESETS", "SEQ_BUCKETS", "BATCH_BUCKETS", "bucket_index", "bucket_of",
           "BestFitDB", "Entry", "BuildOptions", "build"]
