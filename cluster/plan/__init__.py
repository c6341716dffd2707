"""Planning: prompts measured in tokens, tasks cut into shards with engine profiles."""
