"""The real scheduler on a simulated clock: a runner that advances virtual time by a fitted step-cost model.

    from labsupport.sim import simulate
    summary = simulate(workload, profile="h100-llama-3.1-8b", max_num_seqs=256)   # bench's keys, "simulated": True

``cost_model.py`` (the features of a step, the linear model, its fit), ``profiles.py`` (a model shape, a KV
budget and coefficients; the roofline GPU profiles), ``calibrate.py`` (the ``cpu`` profile, fitted here),
``virtual_runner.py`` (the runner and the virtual clock), ``simulate.py`` (the engine around them, the driver, the
summary), ``validate.py`` (the same workload real and simulated), ``cli.py`` (``bench simulate``), ``pd_cluster.py``
(several engines on one clock behind the router's policies: replicas, 1P1D and xPyD; DistServe's goodput) and
``kv_link.py`` (the KV connector and the link it times).
"""
from .cost_model import FEATURES, StepCostModel, features_of, fit, step_features
from .profiles import load_profile, save_profile
from .pd_cluster import max_goodput_rate, predict_real_run, simulate_pd, simulate_pd_run
from .simulate import simulate, simulate_run, simulated_engine

__all__ = ["FEATURES", "StepCostModel", "features_of", "fit", "step_features", "load_profile", "save_profile",
           "simulate", "simulate_run", "simulated_engine", "simulate_pd", "simulate_pd_run", "max_goodput_rate",
           "predict_real_run"]
