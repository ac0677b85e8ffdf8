"""The worker process shell shared by every role: set-up, the main loop, heartbeat, entry point."""
