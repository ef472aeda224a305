"""Rollout: the generation of rewarded samples, given a client to generate with.

`generate` runs one rollout (over-sampling, dynamic filters, hand-back of unfinished groups),
`multi_turn` the tool-use loop custom generate functions build on (`tools_example` is one),
`filters` the built-in dynamic-sampling filters. The engines and their HTTP clients live in
serving/; the actor that wires both together is actors/rollout_manager.
"""
