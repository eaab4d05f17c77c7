"""What generates: the native and vLLM engines, the rollout server and transport, and the publications."""
