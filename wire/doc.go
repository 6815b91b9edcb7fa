// Package wire is the home of what the control plane, the agent and the
// clients must agree on beyond the generated schema in gen/: the encodings,
// words and client plumbing every side uses. Its packages import only gen/,
// the standard library and third-party code, never server/ or agent/, so
// both sides (and the CLI) can depend on them without depending on each
// other.
package wire
