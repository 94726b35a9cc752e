"""The userspace dataplane: an asyncio proxy in pyproxy's own process, the last fallback of `--proxy-mode=auto`."""
