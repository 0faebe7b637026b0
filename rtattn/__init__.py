"""rtattn: framework-free attention engine for LLM serving (cuda-python driver API)."""
