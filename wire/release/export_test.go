package release

var LinkedVersion = linkedVersion
