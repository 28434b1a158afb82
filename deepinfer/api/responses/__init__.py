"""OpenAI Responses: requests, output items and their stream events, stored responses."""
