package cli

import (
	"bytes"

	"go.yaml.in/yaml/v3"
)

// yamlFromJSON turns the API's JSON into YAML with the same names, values
// and field order. JSON is YAML already; decoding it into nodes keeps the
// order and the types (an int64, a string in protojson, stays a quoted
// string), and clearing the styles makes it block YAML.
func yamlFromJSON(js []byte) ([]byte, error) {
	var doc yaml.Node
	if err := yaml.Unmarshal(js, &doc); err != nil {
		return nil, err
	}
	blockStyle(&doc)
	var buf bytes.Buffer
	enc := yaml.NewEncoder(&buf)
	enc.SetIndent(2)
	if err := enc.Encode(&doc); err != nil {
		return nil, err
	}
	if err := enc.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

func blockStyle(n *yaml.Node) {
	n.Style = 0
	for _, c := range n.Content {
		blockStyle(c)
	}
}
