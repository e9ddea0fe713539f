"""The engine's statistics (disable_log_stats=False: logged every few seconds, totals for
LLM.get_metrics and the server), an EngineFeature the composition place registers."""
