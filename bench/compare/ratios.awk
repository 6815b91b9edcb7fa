# ratios.awk BASE HEAD: for each benchmark and unit in two files of Go
# benchmark lines, the head/base ratio of the i-th value of each (the same
# round), and of those ratios the median, the lowest and the highest.
function key(name, unit) { return name " (" unit ")" }
FNR == 1 { file++ }
/^Benchmark/ {
	name = $1
	sub(/-[0-9]+$/, "", name) # GOMAXPROCS
	for (i = 3; i < NF; i += 2) {
		k = key(name, $(i + 1))
		if (!(k in seen)) { seen[k] = 1; order[++nk] = k }
		n[file, k]++
		v[file, k, n[file, k]] = $i
	}
}
function sortn(a, m,    i, j, t) {
	for (i = 2; i <= m; i++) { t = a[i]; for (j = i - 1; j >= 1 && a[j] > t; j--) a[j + 1] = a[j]; a[j + 1] = t }
}
END {
	for (o = 1; o <= nk; o++) {
		k = order[o]
		m = n[1, k] < n[2, k] ? n[1, k] : n[2, k]
		if (m == 0) {
			printf "  %-78s only in %s\n", k, (n[1, k] ? "base" : "head")
			continue
		}
		c = 0
		delete r
		for (i = 1; i <= m; i++) if (v[1, k, i] > 0) r[++c] = v[2, k, i] / v[1, k, i]
		if (c == 0) { printf "  %-78s base is 0\n", k; continue }
		sortn(r, c)
		med = (c % 2) ? r[(c + 1) / 2] : (r[c / 2] + r[c / 2 + 1]) / 2
		printf "  %-78s %6.3f [%.3f, %.3f] (%d)\n", k, med, r[1], r[c], c
	}
}
