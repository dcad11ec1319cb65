"""Tests of zeroshard/plan/."""
