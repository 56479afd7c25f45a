"""What outside subscribers need stored: API keys and webhook subscriptions."""
