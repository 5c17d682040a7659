"""The Responses API: requests, conversation items, output and events, stored responses."""
