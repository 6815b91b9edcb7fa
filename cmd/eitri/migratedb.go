package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/spf13/cobra"

	"github.com/a73x/eitri/cmd/eitri/cli"
	"github.com/a73x/eitri/server/store"
)

type migrateDBFlags struct {
	from, to string
}

func newMigrateDBCmd() *cobra.Command {
	var f migrateDBFlags
	cmd := &cobra.Command{
		Use:   "migrate-db --from DATA-DIR|FILE.db --to postgres://…",
		Short: "Copy a SQLite control plane into PostgreSQL, to run replicas on it",
		Long: `Copy everything a control plane on SQLite holds into an empty PostgreSQL
database, so that replicas (eitri server --db URL) go on where it stopped:
users, tokens and console sessions, hosts, join tokens, VMs, exposures, VM
events, quotas, the control plane's identity and counters (which agents
hold it to), and the data dir's TLS and SSH CA files, so replicas present
the certificate agents pinned and the CAs guests trust. It is one
transaction: nothing is written unless everything is.

Stop the old control plane first. Its database is held exclusively while
it is copied, and one still open is refused; whatever it wrote after the
copy would be lost. Do not start it again afterwards: its database is a
backup now.

Agents reconnect to the replicas by themselves (at the same URL, or behind
a load balancer there) and no guest is stopped.

--from is the old data dir (its eitri.db and its tls/ and ssh/ files) or
the path of its eitri.db. --to is a PostgreSQL no control plane has
started on; default $EITRI_DB. Keep a password in EITRI_DB, PGPASSWORD or
~/.pgpass, not on the command line.`,
		Example: `  systemctl stop eitri-server
  export EITRI_DB='postgres://eitri@db.example/eitri?sslmode=verify-full'
  eitri server migrate-db --from /var/lib/eitri
  eitri server --data-dir /var/lib/eitri --public-url https://eitri.example:7443`,
		Args: cli.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error { return runMigrateDB(cmd.Context(), f, cmd.OutOrStdout()) },
	}
	cmd.Flags().StringVar(&f.from, "from", "", "the old control plane's data dir, or its eitri.db")
	// The default is read at run time, not shown here: --help would print
	// a password kept in EITRI_DB.
	cmd.Flags().StringVar(&f.to, "to", "", "the PostgreSQL to copy into, as postgres://USER@HOST/DB?sslmode=verify-full (default $EITRI_DB)")
	return cmd
}

func runMigrateDB(ctx context.Context, f migrateDBFlags, out io.Writer) error {
	if f.from == "" {
		return cli.Usagef("--from: the old control plane's data dir, or its eitri.db")
	}
	if store.IsPostgres(f.from) {
		return cli.Usagef("--from: migrate-db copies from SQLite (a data dir or its eitri.db); to move between PostgreSQL databases use pg_dump")
	}
	to := f.to
	if to == "" {
		to = os.Getenv("EITRI_DB")
	}
	if to == "" {
		return cli.Usagef("--to: the PostgreSQL to copy into, as a postgres:// URL (or set EITRI_DB)")
	}
	if !store.IsPostgres(to) {
		// Not echoed: a mistyped URL may still hold a password.
		return cli.Usagef("--to / EITRI_DB: want a postgres:// or postgresql:// URL")
	}
	dbPath, dataDir := f.from, filepath.Dir(f.from)
	if fi, err := os.Stat(f.from); err == nil && fi.IsDir() {
		dbPath, dataDir = filepath.Join(f.from, "eitri.db"), f.from
	}
	secrets := map[string][]byte{}
	for name := range store.SecretFiles {
		b, err := os.ReadFile(filepath.Join(dataDir, filepath.FromSlash(name)))
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return err
		}
		secrets[name] = b
	}

	src, err := store.OpenSource(ctx, dbPath)
	if err != nil {
		return err
	}
	defer src.Close()
	dst, err := store.Open(ctx, to)
	if err != nil {
		return err
	}
	defer dst.Close()
	copied, err := store.Copy(ctx, src, dst, secrets)
	if err != nil {
		return err
	}
	l, err := dst.Lineage(ctx)
	if err != nil {
		return err
	}

	shown := store.Redact(to)
	fmt.Fprintf(out, "Copied %s to %s:\n", dbPath, shown)
	for _, c := range copied {
		fmt.Fprintf(out, "  %-16s %6d\n", c.Table, c.Rows)
	}
	fmt.Fprintf(out, "Control plane %s, epoch %d, generation %d: agents take the replicas' word as they took the old one's.\n",
		l.ID, l.Epoch, l.Generation)
	if secrets["tls/server.crt"] == nil {
		fmt.Fprintf(out, "\nNo self-made TLS certificate in %s: give every replica the --tls-cert and --tls-key the old control plane had.\n",
			filepath.Join(dataDir, "tls"))
	}
	if secrets["ssh/user_ca"] == nil || secrets["ssh/host_ca"] == nil {
		fmt.Fprintf(out, "\nNo SSH CAs in %s: the first replica makes new ones, and certificates the old ones signed stop working.\n",
			filepath.Join(dataDir, "ssh"))
	}
	envDB := cli.ShellQuote(shown)
	if shown != to {
		envDB = "'<the --to URL>'   # its password is not shown here"
	}
	fmt.Fprintf(out, `
Next:
  1. Keep the old control plane stopped. Its database is a backup now:
     running it again beside the replicas would split the fleet.
  2. Start the replicas on the database, each with the --public-url and
     --tls-hosts the old control plane had (agents dial the URL they enrolled with):
       export EITRI_DB=%s
       eitri server --data-dir %s
     A replica on another machine takes a fresh --data-dir; the secrets come
     from the database.
  3. Agents reconnect by themselves; guests keep running. Tokens, and the
     admin token in %s, work as before.
`, envDB, cli.ShellQuote(dataDir), cli.ShellQuote(filepath.Join(dataDir, "admin.token")))
	return nil
}
