package exposeproxy

import "time"

// warnEvery bounds how often one serve loop logs a recurring condition (at
// its cap, out of descriptors). Each is logged once per streak, but whoever
// calls the port decides when a streak ends (a connection closing frees a
// slot or a descriptor), so without a bound every such toggle would be a
// warning an outsider can force into the agent's log.
const warnEvery = time.Minute

// streak is one recurring condition of one serve loop; not safe for
// concurrent use (each loop has its own).
type streak struct {
	on     bool
	logged time.Time // when a streak of it was last logged
	quiet  int       // streaks begun since then that were not
}

// begin notes that the condition holds. It says whether to log, and if so
// how many streaks since the last logged one went unlogged. The clock is read
// only when a streak starts: a refusal inside one (a datagram flood at the
// cap) costs nothing more than the check.
func (s *streak) begin(clock func() time.Time) (warn bool, unlogged int) {
	if s.on {
		return false, 0
	}
	s.on = true
	now := clock()
	if !s.logged.IsZero() && now.Sub(s.logged) < warnEvery {
		s.quiet++
		return false, 0
	}
	s.logged, unlogged, s.quiet = now, s.quiet, 0
	return true, unlogged
}

// end notes that the condition has cleared.
func (s *streak) end() { s.on = false }
