"""Planning: the memory and communication models and the planner's command line (python -m fairseq.planning.plan_memory)."""
