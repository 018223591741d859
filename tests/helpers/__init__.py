"""What the tests share: real hosts (hostbed), vLLM processes, the fixtures, the inv CLI, a fault proxy."""
