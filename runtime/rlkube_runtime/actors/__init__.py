"""The Ray actors of a job, one module each, above the parts they drive.

trainer: one trainer rank (`TrainerWorker`: advantages, optimizer steps, weight pushes, saves).
rollout_manager: the rollout side (`RolloutManager`: prompts, generation, rewards, eval), with its
    engines behind the router in an `EnginePool` (engine_pool: start, health, replacement, weight
    pushes, memory hand-off).
engine: one rollout engine process (`EngineActor`: the built-in engine or an SGLang server).
"""
