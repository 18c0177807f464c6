"""Architecture registrations that install the adapter over upstream vLLM's model definitions."""
