"""Rollout: engines and the router as processes (`launch`), HTTP clients for them (`client`),
and the generation of rewarded samples on top (`generate`, `manager`)."""
