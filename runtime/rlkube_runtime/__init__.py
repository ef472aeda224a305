"""rlkube's runtime: the RLJob spec, RL math, data, rewards, rollout engines, trainers and the loop.

Importing this package must stay cheap (no torch, no ray): the operator and `rlkube validate`
import the spec from here.
"""

__version__ = "0.1.0"
