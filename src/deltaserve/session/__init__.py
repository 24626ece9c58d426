"""The session layer: the resident session (`resident`), the conversation state store (`store`), sampling
(`sampling`), structured outputs (`grammar`) and the one chat-turn pipeline every frontend goes through (`turns`).
Below it the engine, the runtime and the text layer; above it only the frontends and the API."""
